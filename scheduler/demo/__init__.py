"""The closed-loop demo (``undertow demo``): the stack, the simulated developers, the orchestration
and the final report. Entry point: :func:`scheduler.demo.run.run_demo`."""
