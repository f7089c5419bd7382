"""Concept diagrams, one module per chapter, each drawn by matplotlib from a live object of the
package (the real block table after a fork, the real tree after a split), so the picture is
tested like the code. Each function returns a figure; the book shows it as SVG."""
