"""The tensor dtypes a weight push may carry (`TensorSpec.dtype`) and their
sizes in bytes per element: what both ends need to size a manifest's
tensors."""

DTYPE_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
