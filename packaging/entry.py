"""The bundled binary's entry point: the same `main()` as the `gpubroker` console script."""

from gpubroker.cli import main

raise SystemExit(main())
