"""pagedserve component."""
