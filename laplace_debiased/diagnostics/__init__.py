"""Bias diagnostics for mini-batch quadratics (Tatzel et al., ICLR 2025, Sec. 3, Figs. 1-4, 17).

Pure formulas live in :mod:`.directional` (slopes, curvatures, relative bias, Eq. 5 average, CG
step sizes), :mod:`.overlap` (Ω) and :mod:`.bounds` (Eq. 7); direction sets in
:mod:`.directions`; measurements on a partition in :mod:`.measure`; the whole diagnosis in
:mod:`.bias`; plots, JSON and Markdown in :mod:`.report`.
"""
