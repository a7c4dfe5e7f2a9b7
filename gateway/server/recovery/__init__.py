"""The recovery coordinator: where an interrupted request resumes (dispatch), where a dead holder's
checkpoints go (re-homing), and which restarting worker drafts for which survivor (pairing)."""
