from spectune.cli import main

raise SystemExit(main())
