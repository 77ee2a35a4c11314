"""The run's resident engine: one process that keeps the run's models loaded across stages and
iterations and runs the stages the pipeline's tasks hand it.

- ``server``: ``kfrl engine serve`` (HTTP: ``POST /stages``, ``POST /shutdown``, ``GET /health``;
  a per-run token).
- ``client``: what a task does with its stage (hand it over, or run it itself where allowed), and
  ``EngineProcess``, the engine the local driver starts.
- ``workload``: the engine on Kubernetes: a Pod + Service (+ token Secret, NetworkPolicy) per run,
  owned by the driver's pod; created, watched, restarted and deleted by the driver.
"""
