"""The Program IR and its passes: the ops with their work, the Program and its text form, the
builder schedules emit with, validation, and the lowering passes (DeepEP's host wait, explicit
ranks, symmetry reduction) both interpreters run after a schedule."""
