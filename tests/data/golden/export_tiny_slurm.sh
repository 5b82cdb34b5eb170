exit 0
wrote WORK/export_slurm.sh (slurm, 224 bytes)
wrote WORK/export_slurm.gpus (slurm, 144 bytes)
wrote WORK/export_slurm.launch.sh (slurm, 3,903 bytes)
rack00-tray00
rack00-tray00
rack00-tray01
rack00-tray01
rack02-tray00
rack02-tray00
rack02-tray01
rack02-tray01
rack01-tray00
rack01-tray00
rack01-tray01
rack01-tray01
rack04-tray00
rack04-tray00
rack04-tray01
rack04-tray01
