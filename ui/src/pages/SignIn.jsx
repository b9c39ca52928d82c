// Sign in to a room with its submitter token, or create a room (its two tokens are shown once).
import { useState } from "react";
import { useLocation, useNavigate } from "react-router-dom";
import { api } from "../lib/api.js";
import { useAuth } from "../lib/auth.jsx";
import { CopyButton, Notice } from "../components/bits.jsx";

function explain(err) {
  if (err.status === 401) return "This token does not open any room. Check that you copied all of it.";
  // 403: a token of the room that may not sign in (a donor token); the server says which one does
  if (err.status === 403) return `This token cannot open the dashboard: ${err.message}`;
  return err.message;
}

function TokenToShow({ title, token, testId, children }) {
  return (
    <div className="token-block">
      <p>
        <strong>{title}</strong>: {children}
      </p>
      <div className="token-row">
        <code className="token" data-testid={testId}>
          {token}
        </code>
        <CopyButton text={token} label={`Copy ${title.toLowerCase()}`} />
      </div>
    </div>
  );
}

export default function SignIn() {
  const { signIn, notice } = useAuth();
  const navigate = useNavigate();
  const location = useLocation();
  const [token, setToken] = useState("");
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const [name, setName] = useState("");
  const [created, setCreated] = useState(null);
  const [createError, setCreateError] = useState(null);
  const next = location.state?.from || "/";

  const submit = async (e) => {
    e.preventDefault();
    if (!token.trim()) return setError("Paste the room's submitter token first.");
    setBusy(true);
    setError(null);
    try {
      await signIn(token);
      navigate(next, { replace: true });
    } catch (err) {
      setError(explain(err));
    } finally {
      setBusy(false);
    }
  };

  const create = async (e) => {
    e.preventDefault();
    setCreateError(null);
    try {
      setCreated(await api.createRoom(name.trim()));
    } catch (err) {
      setCreateError(err.message);
    }
  };

  const enter = async () => {
    await signIn(created.token);
    navigate("/", { replace: true });
  };

  return (
    <main className="signin">
      <h1>
        <span className="brand-mark">zwdx</span> dashboard
      </h1>
      <p className="muted">GPUs lent by people, pooled for PyTorch training.</p>
      {notice && <Notice kind="warning" title="Signed out">{notice}</Notice>}

      <section className="card">
        <h2>Sign in to a room</h2>
        <form onSubmit={submit}>
          <label htmlFor="token">Submitter token</label>
          <input
            id="token"
            type="password"
            autoComplete="off"
            spellCheck="false"
            placeholder="zs_…"
            value={token}
            onChange={(e) => setToken(e.target.value)}
          />
          <button type="submit" disabled={busy}>
            {busy ? "Checking…" : "Sign in"}
          </button>
          <p className="muted small">
            The room's submitter token (<code>zs_…</code>, or a room's older <code>zr_…</code>); its donor token
            (<code>zd_…</code>) only connects GPU clients. The token stays in this browser tab only and is sent in a
            header, never in a URL.
          </p>
        </form>
        {error && (
          <Notice kind="error" title="Sign-in failed" testId="signin-error">
            {error}
          </Notice>
        )}
      </section>

      <section className="card">
        <h2>Create a room</h2>
        {!created ? (
          <form onSubmit={create}>
            <label htmlFor="room-name">Name</label>
            <input id="room-name" placeholder="my-lab" maxLength={100} value={name} onChange={(e) => setName(e.target.value)} />
            <button type="submit" className="button-secondary">
              Create room
            </button>
            {createError && <Notice kind="error">{createError}</Notice>}
          </form>
        ) : (
          <div data-testid="created-room">
            <p>
              Room <strong>{created.name}</strong> created. Its two tokens are shown <strong>only this once</strong>:
              copy them now and keep them safe.
            </p>
            <TokenToShow title="Submitter token" token={created.token} testId="new-token">
              submits jobs, reads their results, opens this dashboard and manages the room&apos;s tokens. Keep it to
              yourself.
            </TokenToShow>
            <TokenToShow title="Donor token" token={created.donor_token} testId="new-donor-token">
              for the people who lend GPUs: it connects GPU clients and opens nothing else.
            </TokenToShow>
            <p className="muted small">
              Lend a GPU to it: keep the donor token in a file only you can read (a command line is visible to every
              user of the machine), then
            </p>
            <pre className="cmd">
              zwdx gpu-client --server {window.location.origin} --room-token-file donor-token
            </pre>
            <button type="button" onClick={enter}>
              Open the room
            </button>
          </div>
        )}
      </section>
    </main>
  );
}
