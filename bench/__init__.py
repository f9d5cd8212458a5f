"""The benchmarks: run each as ``.venv/bin/python -m bench.<name>`` from the repository's root (bench/README.md)."""
