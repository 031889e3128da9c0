"""Running a loaded model: generation, sampling, CUDA graphs, compilation, routing recorders.

- `load`: a model with the expert cache and the K/V composed around it (`Loaded`);
- `generate`: the prefill and decode loop; `decode_steps`: eager and CUDA-graph rounds;
- `piecewise`, `compile`: graphs cut at the experts' host calls, `torch.compile`;
- `sampling`: the sampler (an exponential race; `_sampling_triton`, its CUDA kernels);
  `recording`: routing counters and trace recorders.
"""
