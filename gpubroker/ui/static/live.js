// gpubroker's live pages: one event stream per browser, shared by its tabs.
//
// Browsers allow six connections per host, so a seventh tab must not open a seventh
// stream. The tabs elect a leader with a Web Lock (held until the tab closes, then
// granted to the next tab waiting for it); the leader holds the only EventSource and
// rebroadcasts each message on a BroadcastChannel; the others listen. A new leader
// resumes after the last id any tab saw. On a message the page fetches its own
// live region again (/fragment/<page>) — once per burst, never per row, never on a timer.
(() => {
  "use strict";
  const main = document.getElementById("live");
  const badge = document.getElementById("live-state");
  const types = (document.body.dataset.events || "").split(" ").filter(Boolean);
  const channel = "BroadcastChannel" in window ? new BroadcastChannel("gpubroker-live") : null;
  let lastId = null;
  let leading = false;
  let live = false;
  let timer = null;

  function status(on) {
    live = on;
    if (badge) {
      badge.textContent = on ? "live" : "offline";
      badge.classList.toggle("on", on);
    }
  }

  async function load() {
    timer = null;
    const focused = document.activeElement;
    if (focused && main.contains(focused) && focused.closest("form")) {
      timer = setTimeout(load, 1000); // not while someone is choosing a filter
      return;
    }
    try {
      const answer = await fetch(main.dataset.fragment + location.search, { cache: "no-store" });
      if (answer.status === 401) {
        // Signed out (the broker restarted, the session ended, another tab signed out): a page that stayed would
        // go stale without a word, so on to the sign-in form, which leads back here.
        location.assign("/login?next=" + encodeURIComponent(location.pathname + location.search));
        return;
      }
      if (answer.ok) {
        // What a person opened (the whole of an event's long detail) stays open as the region is drawn again.
        const opened = new Set([...main.querySelectorAll("details[open]")].map(place));
        main.innerHTML = await answer.text();
        for (const details of main.querySelectorAll("details")) if (opened.has(place(details))) details.open = true;
      }
    } catch (_) {
      // the broker is restarting: the stream's reconnect brings the next message
    }
  }

  // A <details> by what it is, not where: its event's seq and its summary, the same once drawn again.
  function place(details) {
    const item = details.closest("[data-seq]");
    const summary = details.querySelector("summary");
    return (item ? item.dataset.seq : "") + " " + (summary ? summary.textContent : "");
  }

  function refresh() {
    if (main && main.dataset.fragment && timer === null) timer = setTimeout(load, 250); // a burst is one fetch
  }

  function deliver(message) {
    if (message.id) lastId = message.id;
    refresh();
  }

  function stream() {
    const url = "/v1/stream" + (lastId ? "?after=" + encodeURIComponent(lastId) : "");
    const source = new EventSource(url); // on reconnect it sends Last-Event-ID itself
    const pass = (event) => {
      const message = { kind: "event", type: event.type, id: event.lastEventId || null, data: event.data };
      if (channel) channel.postMessage(message);
      deliver(message);
    };
    for (const type of types) source.addEventListener(type, pass);
    source.onopen = () => {
      status(true);
      if (channel) channel.postMessage({ kind: "status", live: true, id: lastId });
    };
    source.onerror = () => {
      status(false);
      if (channel) channel.postMessage({ kind: "status", live: false, id: lastId });
      if (source.readyState === EventSource.CLOSED) {
        refresh(); // refused (401 once signed out, 429) or gone: the region's own fetch says which
        setTimeout(stream, 10000); // the browser will not retry by itself
      }
    };
  }

  function lead() {
    leading = true;
    refresh(); // messages may have passed between the old leader's going and this one's start
    stream();
    return new Promise(() => {}); // the lock is held until this tab closes
  }

  if (channel) {
    channel.onmessage = (event) => {
      const message = event.data || {};
      if (message.kind === "hello") {
        if (leading) channel.postMessage({ kind: "status", live, id: lastId });
      } else if (message.kind === "status") {
        if (!leading) {
          status(Boolean(message.live));
          if (message.id) lastId = message.id;
        }
      } else if (message.kind === "event" && !leading) {
        deliver(message);
      }
    };
  }

  // Times read "3 min ago" with the exact time on hover; they age in place, on this clock, without asking the broker.
  function words(seconds) {
    const s = Math.max(0, Math.floor(seconds));
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + " min";
    if (s < 86400) return Math.floor(s / 3600) + " h";
    return Math.floor(s / 86400) + " d";
  }

  function tick() {
    const now = Date.now() / 1000;
    for (const time of document.querySelectorAll("time[datetime]")) {
      const at = Date.parse(time.getAttribute("datetime")) / 1000;
      if (!Number.isNaN(at)) time.textContent = at <= now ? words(now - at) + " ago" : "in " + words(at - now);
    }
  }
  setInterval(tick, 15000);

  // Actions: a button with data-url is one API call, sent with the page's CSRF token; the answer is shown above the page.
  const csrf = document.querySelector('meta[name="csrf-token"]');
  const notice = document.getElementById("notice");

  function tell(text, bad) {
    if (!notice) return;
    notice.textContent = text;
    notice.hidden = false;
    notice.classList.toggle("bad", Boolean(bad));
  }

  document.addEventListener("click", async (event) => {
    const button = event.target.closest("button.act");
    if (!button) return;
    event.preventDefault();
    button.disabled = true;
    const method = button.dataset.method || "POST";
    const headers = { "Content-Type": "application/json" };
    if (csrf) headers["X-CSRF-Token"] = csrf.content;
    try {
      const answer = await fetch(button.dataset.url, {
        method,
        headers,
        body: method === "DELETE" ? undefined : "{}",
        credentials: "same-origin",
      });
      const body = await answer.json().catch(() => ({}));
      const failure = body.error || {};
      if (answer.ok) {
        const shown = button.dataset.show ? body[button.dataset.show] : null;
        const lease = body.lease ? " lease " + body.lease.id + (body.lease.reason ? " (" + body.lease.reason + ")" : "") : "";
        tell(shown ? button.textContent + ": " + shown : button.textContent + " done:" + (lease || " " + button.dataset.url));
      } else if (failure.details && failure.details.cancelled) {
        tell(failure.message);
      } else {
        tell((failure.code || answer.status) + ": " + (failure.message || answer.statusText), true);
      }
    } catch (error) {
      tell("the broker did not answer: " + error, true);
    } finally {
      button.disabled = false;
      refresh();
    }
  });

  if (channel && navigator.locks) {
    navigator.locks.request("gpubroker-stream", lead);
    channel.postMessage({ kind: "hello" });
  } else {
    lead(); // no way to share: this tab holds its own stream
  }
})();
