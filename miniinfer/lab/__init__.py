"""The book's lab: what ``make chapter-NN`` records for each chapter (its recordings, their plans
and time estimates, and ``repro``, which runs them and executes the notebook). Above the book's
display code (:mod:`miniinfer.book`), which only reads what these write."""
