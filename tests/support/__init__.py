"""What the tests share: harnesses (ranks, parity, CLI runs), measurements, the CUDA-shaped
device (fakecuda), sitecustomize folders for subprocesses. Imported as tests.support.X."""
