"""Pure-torch references of the ops: the oracles in tests, and the CPU path where autograd needs them
(training; CPU inference runs the attention in the ``gr_kv`` C++ kernels: `gr_plugin.ops.hstu_attention`)."""
