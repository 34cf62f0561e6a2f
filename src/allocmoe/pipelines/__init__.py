"""Pipelines over the floors below: the sweep (sweep.py) profiles and allocates (calibrate/), then
scores every plan and writes the report (measure/)."""
