from lss.cli import main

raise SystemExit(main())
