"""Settings: the Hugging Face token (password field, checked with the hub off the GUI thread, stored only in the
system keyring), tool paths and defaults (saved in the platform config dir)."""

from __future__ import annotations

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from ..core import secrets
from ..core import settings as user_settings
from ..core.cluster import host_port
from ..core.errors import UserError
from ..core.stage_options import DEVICES, PRECISION_NAMES
from ..core.targets import KNOWN_SOCS
from . import worker


def device_choice(current: str) -> QComboBox:
    """Where adapt and quantize run their torch work; the GPU is offered even when absent (it is refused
    then, with the reason)."""
    labels = {"auto": "Automatic: the CUDA GPU when there is one", "cpu": "CPU", "cuda": "CUDA GPU"}
    box = QComboBox()
    for key in DEVICES:
        box.addItem(labels.get(key, key), key)
    box.setCurrentIndex(max(0, box.findData(current)))
    return box


class SettingsDialog(QDialog):
    def __init__(self, parent: QWidget, s: user_settings.Settings) -> None:
        super().__init__(parent)
        self.setWindowTitle("NPU Studio settings")
        self.settings = s
        lay = QVBoxLayout(self)
        lay.addWidget(self._token_group())
        lay.addWidget(self._tools_group(s))
        lay.addWidget(self._cluster_group(s))
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel)
        lay.addWidget(buttons)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        self.check_save.clicked.connect(self._check_and_save)
        self.save_unchecked.clicked.connect(lambda: self._store(self.token.text().strip(), None))
        self.forget.clicked.connect(self._forget)
        self.job: worker.Job | None = None

    def _token_group(self) -> QGroupBox:
        tok = QGroupBox("Hugging Face token (for gated models such as Llama)")
        tl = QVBoxLayout(tok)
        self.token = QLineEdit()
        self.token.setEchoMode(QLineEdit.EchoMode.Password)
        self.token.setPlaceholderText("hf_… (kept only in the system keyring)")
        row = QHBoxLayout()
        self.check_save = QPushButton("Check and save")
        self.save_unchecked = QPushButton("Save without checking")
        self.forget = QPushButton("Remove")
        for b in (self.check_save, self.save_unchecked, self.forget):
            row.addWidget(b)
        self.token_status = QLabel("A token is stored." if secrets.get_hf_token() else "No token is stored.")
        self.token_status.setWordWrap(True)
        tl.addWidget(self.token)
        tl.addLayout(row)
        tl.addWidget(self.token_status)
        return tok

    def _tools_group(self, s: user_settings.Settings) -> QGroupBox:
        paths = QGroupBox("Tools and defaults")
        form = QFormLayout(paths)
        self.sdk = QLineEdit(s.qnn_sdk_root)
        self.sdk.setPlaceholderText("QAIRT SDK folder (optional; else QNN_SDK_ROOT)")
        self.adb = QLineEdit(s.adb_path)
        self.adb.setPlaceholderText("adb binary (optional; else the one on PATH or shipped with adbutils)")
        self.mnn = QLineEdit(s.mnn_android_root)
        self.mnn.setPlaceholderText("MNN Android build with llm_demo (for the MNN model on a phone; else "
                                    "MNN_ANDROID_ROOT)")
        self.target = QComboBox()
        for soc in KNOWN_SOCS.values():
            self.target.addItem(f"{soc.soc} — {soc.product}", soc.soc)
        self.target.setCurrentIndex(max(0, self.target.findData(s.default_target)))
        self.precision = QComboBox()
        self.precision.addItems(list(PRECISION_NAMES))
        self.precision.setCurrentText(s.default_precision)
        self.device = device_choice(s.device)
        self.preview = QCheckBox("The virtual device answers with the CPU preview (fast) instead of Genie on the "
                                 "HTP simulator")
        self.preview.setChecked(s.virtual_preview)
        self.sdk_browse, self.adb_browse = QPushButton("Browse…"), QPushButton("Browse…")
        self.mnn_browse = QPushButton("Browse…")
        self.sdk_browse.clicked.connect(lambda: self._browse(self.sdk, folder=True))
        self.adb_browse.clicked.connect(lambda: self._browse(self.adb, folder=False))
        self.mnn_browse.clicked.connect(lambda: self._browse(self.mnn, folder=True))
        for label, edit, browse in (("QNN SDK:", self.sdk, self.sdk_browse), ("adb:", self.adb, self.adb_browse),
                                    ("MNN Android runtime:", self.mnn, self.mnn_browse)):
            row = QHBoxLayout()
            row.addWidget(edit, 1)
            row.addWidget(browse)
            form.addRow(label, row)
        form.addRow("Default target:", self.target)
        form.addRow("Default precision:", self.precision)
        form.addRow("Compute on:", self.device)
        form.addRow("", self.preview)
        return paths

    def _cluster_group(self, s: user_settings.Settings) -> QGroupBox:
        ray = QGroupBox("Ray cluster (for models that outgrow this computer)")
        rf = QFormLayout(ray)
        self.cluster_address = QLineEdit(s.cluster_address)
        self.cluster_address.setPlaceholderText("HOST:PORT as `ray start --head` printed it, or ray://HOST:10001")
        self.use_cluster = QCheckBox("Run heavy stages on the cluster (adapt, quantize, compile; their files come "
                                     "back into the project)")
        self.use_cluster.setChecked(s.use_cluster)
        self.cluster_install = QCheckBox("Ray installs this computer's package versions on the workers first "
                                         "(they need their package index)")
        self.cluster_install.setChecked(s.cluster_install)
        self.cluster_status = QLabel("")
        self.cluster_status.setWordWrap(True)
        rf.addRow("Ray cluster address:", self.cluster_address)
        rf.addRow("", self.use_cluster)
        rf.addRow("", self.cluster_install)
        rf.addRow("", self.cluster_status)
        return ray

    def _check_and_save(self) -> None:
        token = self.token.text().strip()
        self.check_save.setEnabled(False)
        self.token_status.setText("Checking the token with the Hugging Face hub…")

        def failed(problem: str, fix: str) -> None:
            self.check_save.setEnabled(True)
            self.token_status.setText(f"{problem} {fix}")

        self.job = worker.start(lambda _s: secrets.validate_hf_token(token), "Checking the token",
                                done=lambda user: self._store(token, user), failed=failed)

    def _store(self, token: str, user: str | None) -> None:
        self.check_save.setEnabled(True)
        if not token:
            self.token_status.setText("Paste a token first.")
            return
        try:
            secrets.set_hf_token(token)
        except UserError as e:  # a missing or locked keyring: say so, never fall back to a file
            self.token_status.setText(f"{e.problem} {e.fix}")
            return
        self.token.clear()
        self.token_status.setText(f"Token of {user} saved in the system keyring." if user else
                                  "Token saved in the system keyring (not checked).")

    def _forget(self) -> None:
        try:
            secrets.delete_hf_token()
            self.token_status.setText("Token removed from the system keyring.")
        except UserError as e:  # no usable keyring: nothing was removed, and the dialog says so
            self.token_status.setText(f"{e.problem} {e.fix}")
        except Exception as e:
            self.token_status.setText(f"The keyring refused ({e.__class__.__name__}).")

    def _browse(self, edit: QLineEdit, folder: bool) -> None:
        """Pick the SDK folder or the adb binary instead of typing its path (the fields had no Browse…)."""
        start = edit.text().strip()
        opt = QFileDialog.Option.DontUseNativeDialog
        if folder:
            path = QFileDialog.getExistingDirectory(self, "QAIRT SDK folder", start, options=opt)
        else:
            path, _ = QFileDialog.getOpenFileName(self, "adb binary", start, options=opt)
        if path:
            edit.setText(path)

    def accept(self) -> None:
        address = self.cluster_address.text().strip()
        if address or self.use_cluster.isChecked():
            try:
                host_port(address)
            except UserError as e:
                self.cluster_status.setText(f"{e.problem} {e.fix}")
                return
        s = self.settings
        s.cluster_address, s.use_cluster = address, self.use_cluster.isChecked()
        s.cluster_install = self.cluster_install.isChecked()
        s.qnn_sdk_root, s.adb_path = self.sdk.text().strip(), self.adb.text().strip()
        s.mnn_android_root = self.mnn.text().strip()
        s.default_target, s.default_precision = str(self.target.currentData()), self.precision.currentText()
        s.virtual_preview = self.preview.isChecked()
        s.device = self.device.currentData()
        user_settings.save(s)
        s.apply()
        super().accept()
