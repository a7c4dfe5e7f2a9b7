"""Wire schemas shared by the gateway and the workers. Imports nothing else from the project."""
