"""Methods with a frozen (or closed-form) classifier, compared in the FedDr+ paper; base.py holds the fixed heads."""
