"""What both runners share: the job's spec and its CRD, the gang view, the restart policy, the summary.

Pure decisions with plain inputs and outputs; imports neither runner.
"""
