"""What runs beside training.

``supervisor`` (the processes of the launcher and the cluster benchmark)
and ``hlo`` (traffic read from compiled programs).
"""
