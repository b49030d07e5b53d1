"""Everything both interpreters share: workload, hardware, ops, the Program IR, schedules, Trace.

Importing this package never imports torch, simpy or matplotlib.
"""
