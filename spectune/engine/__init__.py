"""The reference continuous-batching engine and the A/B bench that drives it.

Not part of what a server embeds: it imports ``spectune.runtime`` the way any server would
(``load`` a table, ``plan`` each step, the graph-captured verifier, ``observe`` one step late).
"""
