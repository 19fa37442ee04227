"""Other engines benchmarked beside portside (`ci/bench/cpu.py --peers`): each in its own virtual
environment, built on demand (`venvs.ensure_venv`), run as a subprocess through a small harness
(`vllm_cpu_run.py`, `llama_cpp_run.py`) that prints its figures as JSON."""
