"""The one error type a bad model file raises.

Every problem with a file the user handed us (missing, truncated, foreign, wrong layout) becomes a
ModelFileError whose text names the file and the problem on one line; command-line tools print that
line and exit 1 instead of showing a traceback.
"""


class ModelFileError(Exception):
    def __init__(self, path, problem):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class BackendError(ValueError):
    """A backend that cannot serve: unknown name, not installed, no device, or missing an
    operation. One line that names the backend and why; commands print it and exit 1."""
