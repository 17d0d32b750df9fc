# Poison every fresh output of the operators with NaN / a bad index before the library writes
# them, so an element a backend forgets to write fails the comparisons. Must be set before the
# extension is first used.
import os

os.environ.setdefault("FLASHMSA_POISON", "1")
