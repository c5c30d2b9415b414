from verispec.cli import main

raise SystemExit(main())
