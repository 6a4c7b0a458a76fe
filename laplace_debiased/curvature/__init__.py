"""The curvature maths: pure functions and operators, tensors in, tensors out.

* :mod:`.linalg` -- the debiasing formulas (diag(UᵀCU), debiased K-FAC factors), in float64;
* :mod:`.operators` -- curvature-vector products of mini-batch quadratics (over curvlinops);
* :mod:`.eigen` -- top-k eigenpairs (Lanczos or Gram route) and their re-measurement on B̃.
"""
