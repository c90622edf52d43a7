"""`llmmesh bench`: replays traffic profiles against the mesh and its peers, and reports.

profile (what traffic) → workload (the exact requests and arrival times, same for every target)
→ loadgen (open or closed loop against one target) → metrics → report. `runner` wires them.
"""
