from fpdt.plan.cli import main; import sys; sys.exit(main())
