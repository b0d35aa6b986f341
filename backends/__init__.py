"""Store backends: one module or package per store."""
