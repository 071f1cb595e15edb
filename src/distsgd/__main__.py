from distsgd.cli import main

raise SystemExit(main())
