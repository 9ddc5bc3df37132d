// SPDX-License-Identifier: AGPL-3.0-only
// The released `e2b` npm package, unmodified, against the OpenDsec E2B gateway. Configured
// only by E2B_API_URL, E2B_SANDBOX_URL, E2B_VOLUME_API_URL and E2B_API_KEY (from
// <data-dir>/e2b.env).
// Usage: node scenarios.mjs <template>   (prints "ok <scenario>" per scenario; exits 1 on
// the first failure, with the error)
import assert from 'node:assert/strict'
import { createHash, randomBytes } from 'node:crypto'
import net from 'node:net'

import { Sandbox as CodeInterpreter } from '@e2b/code-interpreter'
import {
  CommandExitError,
  FileType,
  FilesystemEventType,
  NotFoundError,
  Sandbox,
  SandboxError,
  SandboxNotFoundError,
  TimeoutError,
  AuthenticationError,
  Volume,
} from 'e2b'

const template = process.argv[2] ?? 'base'
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const sha256 = (b) => createHash('sha256').update(b).digest('hex')
// How many `sleep 1000` processes a sandbox runs (its images have no pgrep)
const SLEEPERS = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null; echo; done | grep -c '^sleep 1000' || true"

async function until(pred, ms = 10_000) {
  const end = Date.now() + ms
  while (Date.now() < end) {
    if (await pred()) return true
    await sleep(100)
  }
  return false
}

const scenarios = {
  async commands() {
    const sb = await Sandbox.create(template, { timeoutMs: 120_000, envs: { FROM_CREATE: 'c1' } })
    try {
      assert.equal(await sb.isRunning(), true)
      let r = await sb.commands.run('echo hi')
      assert.deepEqual([r.stdout, r.stderr, r.exitCode], ['hi\n', '', 0])
      r = await sb.commands.run('echo $FROM_CREATE $PER_CMD; echo oops >&2; pwd', {
        envs: { PER_CMD: 'p2' },
        cwd: '/tmp',
      })
      assert.equal(r.stdout, 'c1 p2\n/tmp\n')
      assert.equal(r.stderr, 'oops\n')
      await assert.rejects(sb.commands.run('echo partial; exit 3'), (e) => {
        assert.ok(e instanceof CommandExitError)
        assert.equal(e.exitCode, 3)
        assert.equal(e.stdout, 'partial\n')
        return true
      })
      const seen = []
      await sb.commands.run('for i in 1 2 3; do echo $i; done', { onStdout: (d) => seen.push(d) })
      assert.equal(seen.join(''), '1\n2\n3\n')
      assert.equal((await sb.commands.run('whoami', { user: 'root' })).stdout, 'root\n')
      // E2B's default user, at home; relative paths under its home, its files its own
      assert.match(process.env.E2B_API_KEY, /^e2b_[0-9a-f]{40}$/)
      assert.equal((await sb.commands.run('whoami; pwd')).stdout, 'user\n/home/user\n')
      assert.equal((await sb.files.write('js.txt', 'from js')).path, '/home/user/js.txt')
      assert.equal((await sb.commands.run('stat -c %U js.txt', { cwd: '.' })).stdout, 'user\n')
      // what third-party benchmarks run first; a relative cwd is under the home
      assert.match((await sb.commands.run('node -v')).stdout, /^v\d+\./)
      assert.match((await sb.commands.run('python --version')).stdout, /^Python 3\./)
      await sb.commands.run('mkdir -p rel/dir')
      assert.equal((await sb.commands.run('pwd', { cwd: 'rel/dir' })).stdout, '/home/user/rel/dir\n')
      await assert.rejects(sb.commands.run('sleep 30', { timeoutMs: 1000 }), TimeoutError)
      // background, stdin, kill
      let h = await sb.commands.run('read line; echo got $line', { background: true, stdin: true })
      await sb.commands.sendStdin(h.pid, 'abc\n')
      assert.equal((await h.wait()).stdout, 'got abc\n')
      h = await sb.commands.run('sleep 1000', { background: true, timeoutMs: 0 })
      assert.ok((await sb.commands.list()).some((p) => p.pid === h.pid))
      assert.equal(await sb.commands.kill(h.pid), true)
      await assert.rejects(h.wait(), CommandExitError)
      assert.equal(await sb.commands.kill(999999), false)
      const ended = await sb.commands.run('true', { background: true })
      await ended.wait()
      assert.equal(await sb.commands.kill(ended.pid), false)
      h = await sb.commands.run('cat', { background: true, stdin: true })
      await sb.commands.sendStdin(h.pid, 'ab\n')
      await sb.commands.closeStdin(h.pid)
      assert.equal((await h.wait()).stdout, 'ab\n')
      // PTY
      const out = []
      const pty = await sb.pty.create({ cols: 80, rows: 24, onData: (d) => out.push(Buffer.from(d)) })
      await sb.pty.resize(pty.pid, { cols: 100, rows: 30 })
      await sb.pty.sendInput(pty.pid, new TextEncoder().encode('stty size; exit\n'))
      assert.equal((await pty.wait()).exitCode, 0)
      assert.ok(Buffer.concat(out).toString().includes('30 100'))
      // a second client connects to a running PTY and gets its output
      const p2 = await sb.pty.create({ cols: 80, rows: 24, onData: () => {} })
      const seen2 = []
      const joined = await sb.pty.connect(p2.pid, { onData: (d) => seen2.push(Buffer.from(d)) })
      await sb.pty.sendInput(p2.pid, new TextEncoder().encode('echo via-conn$((6*7)); exit\n'))
      await joined.wait()
      assert.ok(Buffer.concat(seen2).toString().includes('via-conn42'), Buffer.concat(seen2).toString())
    } finally {
      await sb.kill()
    }
  },

  async files() {
    const sb = await Sandbox.create(template, { timeoutMs: 120_000 })
    try {
      const info = await sb.files.write('/tmp/js/a.txt', 'hello file')
      assert.equal(info.path, '/tmp/js/a.txt')
      assert.equal(await sb.files.read('/tmp/js/a.txt'), 'hello file')
      const written = await sb.files.write([
        { path: '/tmp/js/multi/one.txt', data: '1' },
        { path: '/tmp/js/multi/two.txt', data: new Uint8Array([50]) },
      ])
      assert.deepEqual(written.map((w) => w.path).sort(), ['/tmp/js/multi/one.txt', '/tmp/js/multi/two.txt'])
      assert.equal((await sb.commands.run('cat /tmp/js/multi/one.txt /tmp/js/multi/two.txt')).stdout, '12')
      // 100 MiB as multipart/form-data
      const big = Buffer.concat(Array.from({ length: 100 }, () => randomBytes(1 << 20)))
      await sb.files.write('/tmp/js/big.bin', new Blob([big]), { requestTimeoutMs: 300_000 })
      const r = await sb.commands.run('sha256sum /tmp/js/big.bin; rm /tmp/js/big.bin')
      assert.equal(r.stdout.split(' ')[0], sha256(big))
      const bytes = await sb.files.read('/tmp/js/a.txt', { format: 'bytes' })
      assert.equal(Buffer.from(bytes).toString(), 'hello file')
      assert.equal(await sb.files.exists('/tmp/js/a.txt'), true)
      assert.equal(await sb.files.exists('/tmp/js/missing'), false)
      const st = await sb.files.getInfo('/tmp/js/a.txt')
      assert.equal(st.type, FileType.FILE)
      assert.equal(st.size, 10)
      assert.deepEqual((await sb.files.list('/tmp/js')).map((e) => e.name).sort(), ['a.txt', 'multi'])
      assert.equal(await sb.files.makeDir('/tmp/js/newdir'), true)
      assert.equal(await sb.files.makeDir('/tmp/js/newdir'), false)
      const moved = await sb.files.rename('/tmp/js/a.txt', '/tmp/js/newdir/c.txt')
      assert.equal(moved.path, '/tmp/js/newdir/c.txt')
      await sb.files.remove('/tmp/js/newdir')
      assert.equal(await sb.files.exists('/tmp/js/newdir'), false)
      await assert.rejects(sb.files.read('/tmp/js/missing'), NotFoundError)
      // signed URLs, used with no headers at all
      await sb.files.write('/tmp/js/s.txt', 'signed')
      const url = await sb.downloadUrl('/tmp/js/s.txt')
      assert.equal(await (await fetch(url)).text(), 'signed')
      const form = new FormData()
      form.append('file', new Blob(['up!']), 'up.txt')
      const up = await fetch(await sb.uploadUrl('/tmp/js/up.txt'), { method: 'POST', body: form })
      assert.equal(up.status, 200)
      assert.equal(await sb.files.read('/tmp/js/up.txt'), 'up!')
      // watching a directory
      await sb.files.makeDir('/tmp/jw')
      const events = []
      const w = await sb.files.watchDir('/tmp/jw', (e) => events.push([e.name, e.type]), { recursive: true })
      await sb.files.write('/tmp/jw/x.txt', '1')
      await sb.commands.run('mkdir -p /tmp/jw/d && touch /tmp/jw/d/y && rm /tmp/jw/x.txt')
      assert.ok(await until(() => events.some(([n, t]) => n === 'x.txt' && t === FilesystemEventType.REMOVE)))
      await w.stop()
      assert.ok(events.some(([n, t]) => n === 'x.txt' && t === FilesystemEventType.CREATE))
      assert.ok(events.some(([n, t]) => n === 'd/y' && t === FilesystemEventType.CREATE))
    } finally {
      await sb.kill()
    }
  },

  // envd 0.6.2-0.6.4: file metadata kept as extended attributes, entries in watch events
  async metadata() {
    const sb = await Sandbox.create(template, { timeoutMs: 120_000 })
    try {
      const want = { owner: 'js', step: '2' }
      const info = await sb.files.write('jm/a.txt', 'x', { metadata: { owner: 'js', Step: '2' } })
      assert.deepEqual(info.metadata, want)
      // kept as the file's extended attributes (user.e2b.*, or trusted.e2b.* in a VM,
      // whose writable tmpfs keeps no user attributes on the guest's Linux 6.1)
      const xattr = "python3 -c \"import os; f = '/home/user/jm/a.txt'; " +
        "n = [x for x in os.listxattr(f) if x.endswith('e2b.owner')]; print(n[0][:-5], os.getxattr(f, n[0]).decode())\""
      const [prefix, value] = (await sb.commands.run(xattr, { user: 'root' })).stdout.trim().split(' ')
      assert.equal(value, 'js')
      assert.ok(prefix === 'user.e2b.' || (prefix === 'trusted.e2b.' && template !== 'base'), prefix)
      assert.deepEqual((await sb.files.getInfo('jm/a.txt')).metadata, want)
      assert.deepEqual((await sb.files.list('jm')).find((e) => e.name === 'a.txt').metadata, want)
      assert.deepEqual((await sb.files.rename('jm/a.txt', 'jm/b.txt')).metadata, want)
      await sb.files.write('jm/b.txt', 'y')
      const cleared = (await sb.files.getInfo('jm/b.txt')).metadata
      assert.ok(cleared === undefined || Object.keys(cleared).length === 0, JSON.stringify(cleared))
      const events = []
      const w = await sb.files.watchDir('jm', (e) => events.push(e), { includeEntry: true })
      await sb.files.write('jm/c.txt', '123')
      assert.ok(await until(() => events.some((e) => e.name === 'c.txt' && e.entry)))
      await w.stop()
      const e = events.find((e) => e.name === 'c.txt' && e.entry)
      assert.equal(e.entry.path, '/home/user/jm/c.txt')
      assert.equal(e.entry.type, FileType.FILE)
    } finally {
      await sb.kill()
    }
  },

  async lifecycle() {
    const tag = randomBytes(4).toString('hex')
    const a = await Sandbox.create(template, { metadata: { run: tag, role: 'a' } })
    const b = await Sandbox.create(template, { metadata: { run: tag, role: 'b' } })
    try {
      const all = await Sandbox.list({ query: { metadata: { run: tag } } }).nextItems()
      assert.deepEqual(all.map((s) => s.sandboxId).sort(), [a.sandboxId, b.sandboxId].sort())
      const only = await Sandbox.list({ query: { metadata: { run: tag, role: 'b' } } }).nextItems()
      assert.deepEqual(only.map((s) => s.sandboxId), [b.sandboxId])
      assert.deepEqual(only[0].metadata, { run: tag, role: 'b' })
      const desc = await Sandbox.list({ query: { metadata: { run: tag } }, order: 'desc' }).nextItems()
      assert.deepEqual(desc.map((s) => s.sandboxId), [b.sandboxId, a.sandboxId])
      const pager = Sandbox.list({ query: { metadata: { run: tag } }, limit: 1 })
      assert.equal((await pager.nextItems()).length, 1)
      assert.equal(pager.hasNext, true)
      const c = await Sandbox.connect(a.sandboxId)
      // connect gives the envd access token create gave (a process that holds none gets it)
      assert.match(a.envdAccessToken ?? '', /\S/)
      assert.equal(c.envdAccessToken, a.envdAccessToken)
      assert.notEqual((await Sandbox.connect(b.sandboxId)).envdAccessToken, a.envdAccessToken)
      assert.equal((await c.commands.run('echo via connect')).stdout, 'via connect\n')
      const [m] = await c.getMetrics()
      assert.ok(m.cpuCount >= 1 && m.memUsed > 0 && m.memUsed < m.memTotal && m.diskTotal > 0, JSON.stringify(m))
      // a range in the future holds nothing
      const ahead = new Date(Date.now() + 60_000)
      assert.deepEqual(await c.getMetrics({ start: ahead, end: new Date(ahead.getTime() + 60_000) }), [])
      // startedAfter: b was made after a
      const after = await Sandbox.list({ query: { metadata: { run: tag }, startedAfter: new Date((await a.getInfo()).startedAt.getTime() + 1) } }).nextItems()
      assert.ok(!after.some((s) => s.sandboxId === a.sandboxId), JSON.stringify(after))
      const before = (await a.getInfo()).endAt
      await a.setTimeout(600_000)
      assert.ok((await a.getInfo()).endAt - before > 300_000)
      // pause (with its memory by default), and connect resumes; pages run across
      // running and paused sandboxes
      await a.commands.run('echo kept > /tmp/p')
      await a.commands.run('sleep 1000', { background: true, timeoutMs: 0 })
      assert.equal(await a.pause(), true)
      assert.equal((await a.getInfo()).state, 'paused')
      const paged = Sandbox.list({ query: { metadata: { run: tag }, state: ['running', 'paused'] }, limit: 1 })
      const seen = []
      while (paged.hasNext) seen.push(...(await paged.nextItems()).map((s) => `${s.sandboxId}:${s.state}`))
      assert.deepEqual(seen.sort(), [`${a.sandboxId}:paused`, `${b.sandboxId}:running`].sort())
      const r = await Sandbox.connect(a.sandboxId)
      assert.equal((await r.getInfo()).state, 'running')
      assert.equal((await r.commands.run('cat /tmp/p')).stdout, 'kept\n')
      assert.equal((await r.commands.run(SLEEPERS)).stdout, '1\n')
      // kill, and expiry
      assert.equal(await Sandbox.kill(b.sandboxId), true)
      assert.equal(await Sandbox.kill(b.sandboxId), false)
      await assert.rejects(Sandbox.connect(b.sandboxId), SandboxNotFoundError)
      await a.setTimeout(1000)
      assert.ok(await until(async () => !(await a.isRunning()), 15_000))
      await assert.rejects(Sandbox.connect(a.sandboxId), SandboxNotFoundError)
      await assert.rejects(Sandbox.create(template, { apiKey: 'dsk.not-a-real-key' }), AuthenticationError)
    } finally {
      await Sandbox.kill(a.sandboxId)
      await Sandbox.kill(b.sandboxId)
    }
  },

  async snapshots() {
    const sb = await Sandbox.create(template, { timeoutMs: 300_000 })
    const made = []
    const snaps = []
    try {
      await sb.files.write('state.txt', 'before')
      const forks = await sb.fork({ count: 2 })
      made.push(...forks.filter((f) => f instanceof Sandbox))
      assert.equal(made.length, 2, String(forks))
      for (const f of made) assert.equal(await f.files.read('state.txt'), 'before')
      // fork() with no count makes one copy (the array's one entry), of the source as it
      // was then; on the VM backends with its memory, so its processes run in the copy too
      await sb.files.write('fork.txt', 'at fork')
      await sb.commands.run('sleep 1000', { background: true, timeoutMs: 0 })
      const one = await sb.fork({ timeoutMs: 120_000 })
      made.push(...one.filter((f) => f instanceof Sandbox))
      assert.equal(one.length, 1, String(one))
      assert.ok(one[0] instanceof Sandbox, String(one[0]))
      assert.ok(![sb, ...made.slice(0, 2)].some((s) => s.sandboxId === one[0].sandboxId))
      await sb.files.write('fork.txt', 'later')
      assert.equal(await one[0].files.read('fork.txt'), 'at fork')
      assert.equal((await one[0].commands.run(SLEEPERS)).stdout, template === 'base' ? '0\n' : '1\n')
      await one[0].files.write('fork.txt', 'in the copy')
      assert.equal(await sb.files.read('fork.txt'), 'later')
      // and the class's, by id
      const [byId, ...more] = await Sandbox.fork(sb.sandboxId)
      if (byId instanceof Sandbox) made.push(byId)
      assert.ok(byId instanceof Sandbox && more.length === 0, String([byId, ...more]))
      assert.equal(await byId.files.read('fork.txt'), 'later')
      const name = `js-snap-${randomBytes(4).toString('hex')}`
      const info = await sb.createSnapshot({ name })
      snaps.push(info.snapshotId)
      assert.deepEqual(info.names, [name])
      await sb.files.write('state.txt', 'after')
      const listed = await sb.listSnapshots().nextItems()
      assert.deepEqual(listed.map((x) => x.snapshotId), [info.snapshotId])
      const byName = await Sandbox.listSnapshots({ name }).nextItems()
      assert.deepEqual(byName.map((x) => x.snapshotId), [info.snapshotId])
      const everything = await Sandbox.listSnapshots({ limit: 100 }).nextItems()
      assert.ok(everything.some((x) => x.snapshotId === info.snapshotId))
      const r = await Sandbox.create(info.snapshotId, { timeoutMs: 120_000 })
      made.push(r)
      assert.equal(await r.files.read('state.txt'), 'before')
      const r2 = await Sandbox.create(name, { timeoutMs: 120_000 })
      made.push(r2)
      assert.equal(await r2.files.read('state.txt'), 'before')
      assert.equal(await Sandbox.deleteSnapshot(info.snapshotId), true)
      assert.equal(await Sandbox.deleteSnapshot(info.snapshotId), false)
    } finally {
      for (const m of made) await m.kill()
      for (const id of snaps) await Sandbox.deleteSnapshot(id)
      await sb.kill()
    }
  },

  async parity() {
    const tag = randomBytes(4).toString('hex')
    const a = await Sandbox.create(template, { metadata: { par: tag }, timeoutMs: 120_000 })
    try {
      // update_network replaces the rules; one the node refuses is an error
      await a.updateNetwork({ allowOut: ['203.0.113.7'], denyOut: ['0.0.0.0/0'] })
      await assert.rejects(a.updateNetwork({ allowOut: ['10.200.0.0/16'] }))
      // listing by template and order
      const mine = await Sandbox.list({ query: { metadata: { par: tag }, template }, order: 'desc' }).nextItems()
      assert.deepEqual(mine.map((s) => s.sandboxId), [a.sandboxId])
      const none = await Sandbox.list({ query: { metadata: { par: tag }, template: 'no-such-template' } }).nextItems()
      assert.deepEqual(none, [])
    } finally {
      await Sandbox.kill(a.sandboxId)
    }
    // a header rule that would reframe the request is refused before anything is made
    // (rules that set headers: js/network.mjs, against test_network's lab)
    await assert.rejects(
      Sandbox.create(template, {
        timeoutMs: 60_000,
        network: { allowOut: ['api.example.com'], rules: { 'api.example.com': [{ transform: { headers: { 'Content-Length': '1' } } }] } },
      }),
      /Content-Length/,
    )
    const vm = template !== 'base' // a guest takes seconds to boot under emulation
    // keepMemory: false pauses with the files only; connect starts it afresh from them
    const fsOnly = await Sandbox.create(template, { timeoutMs: 120_000 })
    try {
      await fsOnly.files.write('kept.txt', 'fs')
      await fsOnly.commands.run('sleep 1000', { background: true, timeoutMs: 0 })
      assert.equal(await fsOnly.pause({ keepMemory: false }), true)
      assert.equal((await Sandbox.getInfo(fsOnly.sandboxId)).state, 'paused')
      const c = await Sandbox.connect(fsOnly.sandboxId, { timeoutMs: 60_000 })
      assert.equal(await c.files.read('kept.txt'), 'fs')
      // a container starts afresh from its files; a VM's memory is on its disk then
      assert.equal((await c.commands.run(SLEEPERS)).stdout, vm ? '1\n' : '0\n')
    } finally {
      await Sandbox.kill(fsOnly.sandboxId)
    }
    // autoResume: paused at its timeout, woken by a request to one of its ports
    const wake = await Sandbox.create(template, {
      timeoutMs: vm ? 25_000 : 6_000,
      lifecycle: { onTimeout: 'pause', autoResume: true },
    })
    try {
      await wake.files.write('/tmp/srv.py', process.env.PORT_SERVER)
      await wake.commands.run('python3 /tmp/srv.py', { background: true, timeoutMs: 0 })
      const url = process.env.E2B_SANDBOX_URL
      const h = { headers: { 'E2b-Sandbox-Id': wake.sandboxId, 'E2b-Sandbox-Port': '8000' } }
      assert.ok(await until(async () => (await fetch(`${url}/up`, h)).status === 200))
      assert.ok(await until(async () => (await Sandbox.getInfo(wake.sandboxId)).state === 'paused', 60_000))
      const r = await fetch(`${url}/wake`, h)
      assert.equal(r.status, 200)
      assert.ok((await r.text()).startsWith('/wake '))
      assert.equal((await Sandbox.getInfo(wake.sandboxId)).state, 'running')
    } finally {
      await Sandbox.kill(wake.sandboxId)
    }
    // paused, not killed, at its timeout; connect resumes it with its files, and with its
    // processes unless the pause kept no memory (a VM's memory is on its disk then)
    const onTimeout = { full: 'pause', files: { action: 'pause', keepMemory: false } }
    const timed = {}
    try {
      for (const [k, how] of Object.entries(onTimeout)) {
        timed[k] = await Sandbox.create(template, { timeoutMs: vm ? 15_000 : 5_000, lifecycle: { onTimeout: how } })
        await timed[k].files.write('kept.txt', k)
        await timed[k].commands.run('sleep 1000', { background: true, timeoutMs: 0 })
      }
      for (const [k, p] of Object.entries(timed)) {
        assert.ok(await until(async () => (await Sandbox.getInfo(p.sandboxId)).state === 'paused', 60_000), k)
        const c = await Sandbox.connect(p.sandboxId, { timeoutMs: 60_000 })
        assert.equal((await c.getInfo()).state, 'running')
        assert.equal(await c.files.read('kept.txt'), k)
        assert.equal((await c.commands.run(SLEEPERS)).stdout, k === 'full' || template.endsWith('-vm') ? '1\n' : '0\n', k)
      }
    } finally {
      for (const p of Object.values(timed)) await Sandbox.kill(p.sandboxId)
    }
  },

  async volumes() {
    const name = `js-vol-${randomBytes(3).toString('hex')}`
    const vol = await Volume.create(name)
    try {
      assert.ok(vol.token)
      assert.ok((await Volume.list()).some((v) => v.name === name))
      const e = await vol.writeFile('/d/a.txt', 'from js')
      assert.deepEqual([e.path, e.size], ['/d/a.txt', 7])
      assert.equal(await vol.readFile('/d/a.txt'), 'from js')
      const paths = (await vol.list('/', { depth: 2 })).map((x) => x.path).sort()
      assert.deepEqual(paths, ['/d', '/d/a.txt'])
      if (template === 'base' || template === 'base-vm') {
        const sb = await Sandbox.create(template, { timeoutMs: 120_000, volumeMounts: { '/mnt/v': vol } })
        try {
          const r = await sb.commands.run('cat /mnt/v/d/a.txt && echo js > /mnt/v/b.txt')
          assert.equal(r.stdout, 'from js')
          // A VM mounts the volume over virtio-fs, a network mount, where envd refuses a
          // watch unless it allows network mounts (then it sees the sandbox's own changes);
          // a container's is a local mount, watched as any directory.
          const network = template === 'base-vm'
          assert.equal((await sb.commands.run('stat -f -c %T /mnt/v')).stdout.startsWith('fuse'), network)
          if (network) {
            await assert.rejects(sb.files.watchDir('/mnt/v', () => {}), (e) =>
              e instanceof SandboxError && /network filesystem/.test(e.message))
          }
          const seen = []
          const w = await sb.files.watchDir('/mnt/v', (e) => seen.push([e.name, e.type]),
            network ? { allowNetworkMounts: true } : {})
          await sb.files.write('/mnt/v/w.txt', 'watched')
          assert.ok(await until(() => seen.some(([n, t]) => n === 'w.txt' && t === FilesystemEventType.WRITE)), JSON.stringify(seen))
          await w.stop()
        } finally {
          await sb.kill()
        }
        assert.equal(await vol.readFile('/b.txt'), 'js\n')
      } else {
        // volumes mount into containers and QEMU VMs; a Firecracker microVM says so
        await assert.rejects(
          Sandbox.create(template, { timeoutMs: 60_000, volumeMounts: { '/mnt/v': vol } }),
          /container and vm/,
        )
      }
      await vol.remove('/d')
      assert.equal(await vol.exists('/d'), false)
    } finally {
      assert.equal(await Volume.destroy(vol.volumeId), true)
    }
    assert.equal(await Volume.destroy(vol.volumeId), false)
  },

  // @e2b/code-interpreter: matplotlib's figures come back as a PNG and E2B's chart data
  async charts() {
    const ci = template.replace('base', 'code-interpreter-v1')
    const sb = await CodeInterpreter.create(ci, { timeoutMs: 300_000 })
    try {
      let ex = await sb.runCode(
        "import matplotlib.pyplot as plt\n" +
          "plt.plot([1, 2, 3], [4, 5, 6], label='loss')\n" +
          "plt.title('training'); plt.xlabel('step'); plt.ylabel('value')\n" +
          'plt.show()',
        { timeoutMs: 120_000 },
      )
      assert.equal(ex.error, undefined, JSON.stringify(ex.error))
      assert.equal(ex.results.length, 1)
      const [r] = ex.results
      assert.deepEqual([...Buffer.from(r.png, 'base64').subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])
      assert.equal(r.chart.type, 'line')
      assert.deepEqual([r.chart.title, r.chart.x_label, r.chart.y_label], ['training', 'step', 'value'])
      assert.deepEqual(r.chart.elements.map((e) => [e.label, e.points]), [['loss', [[1, 4], [2, 5], [3, 6]]]])
      ex = await sb.runCode("import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [3, 1]); plt.show()")
      assert.equal(ex.results[0].chart.type, 'bar')
      assert.deepEqual(ex.results[0].chart.elements.map((e) => [e.label, e.value]), [['a', 3], ['b', 1]])
      ex = await sb.runCode('1 + 1')
      assert.deepEqual(ex.results.map((x) => x.text), ['2'])
    } finally {
      await sb.kill()
    }
  },

  async ports() {
    const sb = await Sandbox.create(template, { timeoutMs: 120_000 })
    try {
      await sb.files.write('/tmp/srv.py', process.env.PORT_SERVER)
      await sb.commands.run('python3 /tmp/srv.py', { background: true, timeoutMs: 0 })
      const host = sb.getHost(8000)
      const gw = new URL(process.env.E2B_SANDBOX_URL)
      assert.equal(host, `8000-${sb.sandboxId}.localhost:${gw.port}`)
      // as a browser would: a connection to the gateway, with the sandbox host's name
      const get = (path) =>
        new Promise((resolve, reject) => {
          const c = net.connect(Number(gw.port), gw.hostname, () =>
            c.write(`GET ${path} HTTP/1.1\r\nHost: ${host}\r\nConnection: close\r\n\r\n`))
          let data = ''
          c.on('data', (d) => (data += d))
          c.on('end', () => resolve(data))
          c.on('error', reject)
        })
      let resp = ''
      assert.ok(await until(async () => (resp = await get('/from/js')).startsWith('HTTP/1.1 200')))
      assert.ok(resp.endsWith(`/from/js host=${host} auth=None`), resp)
    } finally {
      await sb.kill()
    }
    // network.maskRequestHost: the Host the sandbox's server sees
    const masked = await Sandbox.create(template, {
      timeoutMs: 120_000,
      network: { maskRequestHost: '${PORT}-js.example.com' },
    })
    try {
      await masked.files.write('/tmp/srv.py', process.env.PORT_SERVER)
      await masked.commands.run('python3 /tmp/srv.py', { background: true, timeoutMs: 0 })
      const url = process.env.E2B_SANDBOX_URL
      let text = ''
      assert.ok(await until(async () => {
        const r = await fetch(`${url}/m`, { headers: { 'E2b-Sandbox-Id': masked.sandboxId, 'E2b-Sandbox-Port': '8000' } })
        text = await r.text()
        return r.status === 200
      }))
      assert.equal(text, '/m host=8000-js.example.com auth=None')
    } finally {
      await masked.kill()
    }
    await assert.rejects(
      Sandbox.create(template, { timeoutMs: 60_000, network: { maskRequestHost: 'a b' } }),
      /maskRequestHost/,
    )
    // allowPublicTraffic: false: its ports want its traffic token, which connect gives too
    const priv = await Sandbox.create(template, { timeoutMs: 120_000, network: { allowPublicTraffic: false } })
    try {
      await priv.files.write('/tmp/srv.py', process.env.PORT_SERVER)
      await priv.commands.run('python3 /tmp/srv.py', { background: true, timeoutMs: 0 })
      assert.ok(priv.trafficAccessToken)
      const again = await Sandbox.connect(priv.sandboxId)
      assert.equal(again.trafficAccessToken, priv.trafficAccessToken)
      assert.equal(again.getHost(8000), priv.getHost(8000))
      const url = process.env.E2B_SANDBOX_URL
      const base = { 'E2b-Sandbox-Id': priv.sandboxId, 'E2b-Sandbox-Port': '8000' }
      assert.ok(await until(async () =>
        (await fetch(`${url}/t`, { headers: { ...base, 'E2B-Traffic-Access-Token': again.trafficAccessToken } })).status === 200))
      assert.equal((await fetch(`${url}/t`, { headers: base })).status, 401)
    } finally {
      await priv.kill()
    }
  },

  // getMetrics({ start, end }): the readings (one every 5 s) inside the range, each of
  // them; E2B sends the range in whole seconds
  async metrics() {
    const sb = await Sandbox.create(template, { timeoutMs: 120_000 })
    try {
      let stamps = []
      const readings = async () => (stamps = (await sb.getMetrics()).map((x) => x.timestamp.getTime())).length >= 4
      assert.ok(await until(readings, 40_000), String(stamps))
      assert.deepEqual(stamps, [...stamps].sort((x, y) => x - y))
      const sec = (ms, round) => round(ms / 1000) * 1000
      const range = async (from, upto) => {
        const got = (await sb.getMetrics({ start: new Date(from), end: new Date(upto) })).map((x) => x.timestamp.getTime())
        assert.ok(got.every((t) => t >= from && t <= upto), JSON.stringify({ got, from, upto, stamps }))
        return got
      }
      // from after the first to before the last: the ones between, at least two
      const between = await range(sec(stamps[0] + 1000, Math.ceil), sec(stamps.at(-1) - 1000, Math.floor))
      assert.deepEqual(between, stamps.slice(1, -1), JSON.stringify({ between, stamps }))
      // around one reading (they are 3-7 s apart): that one
      const one = await range(sec(stamps[1] - 1000, Math.floor), sec(stamps[1] + 1000, Math.ceil))
      assert.deepEqual(one, [stamps[1]], JSON.stringify({ one, stamps }))
    } finally {
      await sb.kill()
    }
  },
}

const only = process.argv.slice(3)
for (const [name, run] of Object.entries(scenarios)) {
  if (only.length && !only.includes(name)) continue
  const t0 = Date.now()
  try {
    await run()
  } catch (e) {
    console.log(`FAILED ${name}: ${e?.stack ?? e}`)
    process.exit(1)
  }
  console.log(`ok ${name} ${Date.now() - t0} ms`)
}
