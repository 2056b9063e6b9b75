"""nxdi under NxD Inference's module paths (the `nxdi-compat` distribution). Re-exports only.

Each module here has the path of the NxDI module that defines the names, and imports them from
nxdi (`neuronx_distributed_inference.models.config.NeuronConfig is nxdi.NeuronConfig`), so code
written against NxDI, such as vLLM's Neuron plugin, imports nxdi unmodified. Importing does no
work beyond importing the nxdi modules named.
"""
