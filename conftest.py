# Lets a bare `pytest` import the project modules from the repository root.
