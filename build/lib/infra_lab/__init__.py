"""AI Infra Lab: the code behind the book, one module per concept.

`infra_lab.backend` decides where kernels run; `infra_lab.show(obj)` displays the real source
of anything here; `infra_lab.grading` checks and grades the exercises.
"""
from infra_lab.show import show

__version__ = "0.1.0"
__all__ = ["show", "__version__"]
