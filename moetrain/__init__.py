"""moetrain: a Mixture-of-Experts training toolkit."""
__version__ = "0.1.0"
