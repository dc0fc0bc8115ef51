from pipeline_steps.cli import main

raise SystemExit(main())
