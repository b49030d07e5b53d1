"""What a user describes: the model and batch (workload), the GPU (hardware), the knob records
that declare and check every field, the built-in presets and their files, where ranks sit
(topology) and which experts each token goes to (routing)."""
