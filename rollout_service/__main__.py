"""`python -m rollout_service ...`: the `rollout-service` command."""
import sys

from rollout_service.cli import main

sys.exit(main())
