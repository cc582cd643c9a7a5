"""pagedserve on Ray Serve (``pip install pagedserve[ray]``): one pagedserve
engine (its four processes) per Ray Serve replica, an OpenAI-compatible
ingress, and a request router that sends each request to the replica whose
KV cache holds the longest prefix of its prompt, learnt from the replicas'
KV events (docs/deployment.md, "Ray Serve")."""
