"""The guardian library that runs inside the training process (``Guardian`` and its collaborators).

May import the contract, the tensor helpers and the checkpoint package; nothing imports it but the
package's lazy exports and the command line's checkpoint tools.
"""
