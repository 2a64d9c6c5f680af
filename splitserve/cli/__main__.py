from splitserve.cli.main import main

raise SystemExit(main())
