"""The transport and the job's shape: communicators, boundary-tensor messages and collectives
(`comm`), every wait bounded by the watchdog and every failure told to the other ranks
(`guard`), which rank holds which stage of which replica (`topology`), where ranks run
(`placement`), and the process's signals and threads. Nothing here knows Keras."""
