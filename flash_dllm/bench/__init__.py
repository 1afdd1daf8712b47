"""Load generators and benchmarks (`flash-dllm bench ...`)."""
