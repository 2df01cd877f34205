"""``python -m examples.spark_fanout``: see run.py."""

from examples.spark_fanout.run import main

raise SystemExit(main())
