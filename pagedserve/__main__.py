from pagedserve.cli import main

raise SystemExit(main())
