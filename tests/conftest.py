import os
import sys

# Spawned ranks import the test helpers (model_zoo, parity) by module name.
sys.path.insert(0, os.path.dirname(__file__))
