"""GPU measurements and the one command that runs them with the GPU tests (``bash bench/gpu/run.sh``)."""
