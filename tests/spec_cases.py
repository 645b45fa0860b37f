"""SPEC's correctness length sets, the one home both the CPU and the GPU tests draw from."""

SINGLE_LENGTHS = (1, 15, 16, 17, 31, 63, 64, 65, 121, 251, 257)
PACKED_LENGTHS = {
    "ragged-17-0-16": [17, 0, 16],
    "one-empty": [0],
    "all-empty": [0, 0, 0],
    "short-many": [7] * 24 + [1] * 8,
    "flashkda-mixed": [1300, 547, 2048, 963, 271, 3063],
}
LONG_LENGTH = 16384
MANY_SEQUENCES = 64  # with H = 32
