"""gocomm's benchmarks, apart from the package: `import gocomm` imports none of them.

Run `python -m gocomm.bench.cpu` (gocomm against gloo on CPU tensors, 2 to 4 ranks),
`python -m gocomm.bench.gpu` (gocomm against torch's NCCL on the machine's GPUs) or
`python -m gocomm.bench.moe` (gocomm.moe dispatch and combine against torch's all_to_all).
"""
