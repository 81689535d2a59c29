from gpubroker.cli import main

raise SystemExit(main())
