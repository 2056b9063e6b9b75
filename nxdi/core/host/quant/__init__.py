"""Weight quantization: schemes, quantize/dequantize, and the quantized checkpoint layout. Pure.

`weights` holds the tensor math; `layout` which checkpoint keys are quantized, how a state dict is
written in the reference's quantized layout (`save_quantized_state_dict`) and how a quantized
checkpoint is checked against a scheme before loading; `config` maps a NeuronConfig's settings onto
both. Loading goes through the weight plan (`nxdi.core.weight_plan.WeightQuant`) and the programs
dequantize (`nxdi.core.programs.linear`).
"""
