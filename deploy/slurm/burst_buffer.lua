--[[
Stagehand's burst buffer for Slurm (burst_buffer/lua): a job waits, pending, until the datasets it
names are on the tier it asks for, and runs with their paths in its environment.

A job asks with directive lines in the leading comment block of its batch script:

  #BB_LUA stage dataset=D version=V tier=T [project=P] [name=NAME] [form=raw|prepared] [deadline=DURATION] [hold=DURATION] [capacity=BYTES pool=T|pool=T.P]

  D         dataset name, 1-128 characters of [A-Za-z0-9._-], not starting with '.'
  V         version digest, or a unique prefix of it of at least 12 lowercase hex characters
  T         tier name ([a-z0-9_-], e.g. hot); a tier listed in STAGEHAND_LOCAL_TIERS is
            node-local and staged per node by stagehand-node.sh (Prolog), after this script has
            staged the version to STAGEHAND_HOT_TIER
  P         project (tenant), [a-z0-9_-]; default STAGEHAND_PROJECT of stagehand-slurm.conf
  NAME      the job finds the data at $STAGEHAND_DATA_<NAME> ([A-Za-z0-9_]); default the
            dataset name upper-cased, every other character turned into '_'
  DURATION  deadline: how long the promoter may take, e.g. 90s, 30m, 2h, 1d (default: promotion
            policy); hold: how long the staged data is held at most if the job never releases it
            (a job lost with slurmctld's state, a teardown that failed), counted from the stage
            request — default on 23.02+ the job's time limit plus STAGEHAND_HOLD_SLACK seconds
            (the time it may still queue); on 22.05 (no job_info) held until released
  BYTES     the version's size in the Slurm pool of its tier (a number, optional unit K, KiB,
            KB, M, ... as Slurm reads it): required on a tier of STAGEHAND_POOL_TIERS, refused
            on any other; Slurm stages the job in only when it fits the pool's free space, and
            data_in refuses a version the catalogue says is larger. pool=T.P is the project's
            share of the tier (its quota there less what it holds, never more than T's free)

The hooks (facts: ../../shared/SCHEDULERS.md, "Slurm burst_buffer/lua"):

  slurm_bb_job_process  at submit, inside slurmctld: checks every directive (no I/O but the
                        script and stagehand-slurm.conf); a bad one refuses the job and sbatch
                        prints the reason. On 23.02+ it also refuses a project the job may not
                        stage (`allow` lines, stagehand_slurm.lua); 22.05 passes no uid here, so
                        job_submit.lua (JobSubmitPlugins=lua) refuses it at submit instead
  slurm_bb_data_in      checks who may stage what again, with the job as slurmctld knows it now
                        (`scontrol show job`: user, gid, account); then asks Stagehand
                        (`stagehand stage request`) for each staged version; on
                        22.05 it then waits (`stagehand stage wait`) bounded by
                        STAGEHAND_STAGE_TIMEOUT (<= StageInTimeout), noting where each waiting
                        stage stands (its estimate) in the job's AdminComment every
                        STAGEHAND_STATUS_EVERY seconds; on 24.05+ it only asks
  slurm_bb_test_data_in 24.05+: looks once (`stage wait --timeout 0`), noting a waiting stage
                        in the AdminComment; BUSY until ready
  slurm_bb_pools        inside slurmctld, at start and every 30 s: the tiers of
                        STAGEHAND_POOL_TIERS as pools, and each allowed project's share of
                        each (T.P), from the small file `stagehand tier pool` keeps
                        (STAGEHAND_POOL_FILE); unbounded when it is stale or missing
  slurm_bb_paths        inside slurmctld: copies the paths data_in recorded into the job's
                        environment (STAGEHAND_DATA_<NAME>=<path>); no network
  slurm_bb_job_teardown `stagehand stage release` for each staged version, unless the job is
                        pending again (slurmctld restarted during stage-in: it tears down and
                        stages in again later, and the job still needs its data)
  slurm_bb_get_status   `scontrol show bbstat`: the stages of the caller's own projects
                        (23.02+); nothing on 22.05, which does not say who asks
  the others            nothing to do; defined because 24.05 refuses to start without them

The CLI is run with the NATS credentials named by path only (STAGEHAND_NATS_PASSWORD_FILE,
_CREDS or _NKEY, each readable by the hooks' user alone): no secret is on a command line, where
any user could read it in /proc/<pid>/cmdline.

A failed or timed-out stage returns slurm.ERROR with Stagehand's reason: Slurm holds the job
(priority 0) and squeue's REASON shows "burst_buffer/lua: slurm_bb_data_in: stagehand: ...".
With burst_buffer.conf's Flags=TeardownFailure, teardown then releases what the failed
attempt held (its failed stages stay failed: they hold nothing, and `stagehand status` names
them). Released (`scontrol release`) once the cause is fixed, data_in runs again and, as a
failed stage is final, asks afresh as the run's next attempt (job id `<run>.a<N>`), releasing
the failed one (runbooks/stage-failed.md).

Every hook is idempotent: slurmctld re-runs them after a restart. Request and release ids are
derived from (project, job, dataset, version, tier[, node]) by the CLI, so a repeated request is
the same request; the recorded paths are rewritten whole (temp file, rename).

Settings come from stagehand-slurm.conf beside this script (KEY=VALUE lines, shared with
stagehand-node.sh); see that file for each key.
--]]

local script_dir = (debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$")) or "."

local stagehand_slurm = dofile(script_dir .. "/stagehand_slurm.lua")

local function load_settings()
	return stagehand_slurm.load_settings(script_dir)
end

local function parse_directives(conf, script_path)
	return stagehand_slurm.parse_file(conf, script_path)
end

-- The shared-tier stages data_in makes for the directives: each directive's own tier, or for a
-- node-local directive the hot tier it is copied from (so an unknown or rejected version holds
-- the job before nodes are chosen, and the node copies from a tier already holding it).
local function shared_stages(conf, directives)
	local stages = {}
	for _, d in ipairs(directives) do
		local tier = d.local_tier and conf.STAGEHAND_HOT_TIER or d.tier
		stages[#stages + 1] = {
			dataset = d.dataset,
			version = d.version,
			project = d.project,
			form = d.form,
			deadline = d.deadline,
			hold = d.hold,
			capacity_bytes = d.capacity_bytes,
			tier = tier,
			name = d.name,
			exported = not d.local_tier,
		}
	end
	return stages
end

--- Calling the CLI ------------------------------------------------------------------------------

local quote = stagehand_slurm.quote

local function first_line(s)
	return (s:match("^%s*([^\n]*[^%s])") or "")
end

-- Runs `stagehand <args>`; returns its exit code, stdout and stderr. The NATS credentials are
-- only named by path on its command line (stagehand_slurm.command): settings that would put a
-- secret there, or a credentials file others may read, fail the call (exit 64) with the reason.
local function stagehand(conf, args)
	local problem = stagehand_slurm.credentials_problem(conf)
	if problem then
		return 64, "", problem
	end
	local err_file = os.tmpname()
	local cmd = stagehand_slurm.command(conf, args) .. " 2>" .. quote(err_file) .. "; echo \"stagehand-exit=$?\""
	local p = io.popen(cmd, "r")
	local out = p:read("*a")
	p:close()
	local code = tonumber(out:match("stagehand%-exit=(%d+)%s*$")) or 127
	out = out:gsub("stagehand%-exit=%d+%s*$", "")
	local ef = io.open(err_file, "r")
	local err = ef and ef:read("*a") or ""
	if ef then
		ef:close()
	end
	os.remove(err_file)
	return code, out, err
end

-- `run` is the job id Stagehand sees for this run of the Slurm job ([`run_of`]).
local function stage_args(verb, run, s)
	local args = {
		"stage", verb, s.dataset .. "@" .. s.version,
		"--tier", s.tier,
		"--job", run,
		"--project", s.project,
	}
	return args
end

local function describe(s)
	return s.dataset .. "@" .. s.version .. " on " .. s.tier
end

-- The CLI's exit code for "NATS (or the stages bucket) could not be reached in time".
local EX_UNAVAILABLE = 69

-- Between two attempts at an unreachable NATS: at least a second (an attempt that fails at
-- once, such as a missing bucket, must not spin).
local function pace(started)
	if os.time() - started < 1 then
		os.execute("sleep 1")
	end
end

-- slurmctld.log says when a hook first finds NATS unreachable and when it reaches it again,
-- once each per outage (not per attempt), so a slow stage-in shows where it waited.
local function outage_began(run, s, what, err)
	slurm.log_info("stagehand: %s: %s %s: NATS unreachable, asking again while the stage-in budget lasts: %s", run, what, describe(s), err)
	return os.time()
end

local function outage_ended(run, s, what, since)
	if since then
		slurm.log_info("stagehand: %s: %s %s: NATS reached again after %d s", run, what, describe(s), os.time() - since)
	end
end

-- The hold of a job's stages when its directive gives none: the job's time limit (job_info,
-- 23.02+, in minutes) plus STAGEHAND_HOLD_SLACK seconds for the time it may still queue after
-- stage-in, as a duration for `--hold-until`; nil when unknown (22.05, or no limit: Slurm's
-- INFINITE and NO_VAL are 0xfffffffe and 0xffffffff), which holds until released.
local function job_hold(conf, job_info)
	local limit = type(job_info) == "table" and tonumber(job_info.time_limit) or nil
	if not limit or limit <= 0 or limit >= 0xfffffffe then
		return nil
	end
	local slack = tonumber(conf.STAGEHAND_HOLD_SLACK) or 86400
	return tostring(math.floor(limit * 60 + slack)) .. "s"
end

-- Asks for every stage; nil on success, else a message. An unreachable NATS is asked again
-- (each attempt waits STAGEHAND_CONNECT_TIMEOUT) until `budget` seconds have passed, so a short
-- outage delays jobs instead of holding them.
local function request_all(conf, run, stages, requested_by, budget, default_hold)
	local deadline = os.time() + (budget or 0)
	for _, s in ipairs(stages) do
		local args = stage_args("request", run, s)
		if s.form then
			args[#args + 1] = "--form"
			args[#args + 1] = s.form
		end
		if s.deadline then
			args[#args + 1] = "--deadline"
			args[#args + 1] = s.deadline
		end
		if s.capacity_bytes then
			-- The catalogue's size of the version, not the job's word, decides: a job that
			-- declared less than its data would take more of the pool than Slurm set aside.
			args[#args + 1] = "--declared-size"
			args[#args + 1] = string.format("%.0f", s.capacity_bytes)
		end
		local hold = s.hold or default_hold
		if hold then
			args[#args + 1] = "--hold-until"
			args[#args + 1] = hold
		end
		args[#args + 1] = "--by"
		args[#args + 1] = requested_by
		local attempt = os.time()
		local code, out, err = stagehand(conf, args)
		local outage
		while code == EX_UNAVAILABLE and os.time() < deadline do
			outage = outage or outage_began(run, s, "requesting", first_line(err))
			pace(attempt)
			attempt = os.time()
			code, out, err = stagehand(conf, args)
		end
		outage_ended(run, s, "requesting", code ~= EX_UNAVAILABLE and outage)
		if code ~= 0 then
			return "stagehand: requesting " .. describe(s) .. ": " .. first_line(err ~= "" and err or out)
		end
	end
	return nil
end

-- Looks at (timeout 0) or waits for (timeout > 0) one stage. Returns "ready", path; "failed",
-- reason; "waiting", last state; "unreachable", message; or "error", message.
local function wait_one(conf, run, s, timeout)
	local args = stage_args("wait", run, s)
	args[#args + 1] = "--timeout"
	args[#args + 1] = tostring(timeout)
	local code, out, err = stagehand(conf, args)
	if code == 0 then
		return "ready", first_line(out)
	elseif code == 1 then
		return "failed", first_line(out)
	elseif code == 2 then
		return "waiting", first_line(out)
	elseif code == EX_UNAVAILABLE then
		return "unreachable", first_line(err)
	end
	return "error", first_line(err ~= "" and err or out)
end

-- Releases every stage of `run`, or with `keep_failed` those that did not fail (a failed stage
-- holds nothing, and stays failed so that `stagehand status` names it while its job is held);
-- nil, or a message naming the release that failed.
local function release_all(conf, run, stages, keep_failed)
	for _, s in ipairs(stages) do
		if not (keep_failed and wait_one(conf, run, s, 0) == "failed") then
			local code, out, err = stagehand(conf, stage_args("release", run, s))
			if code ~= 0 then
				return "stagehand: releasing " .. describe(s) .. ": " .. first_line(err ~= "" and err or out)
			end
		end
	end
	return nil
end

-- Whether any stage of `run` failed or was released (`stage wait` exits 1 for both), looking
-- once at each. A stage that cannot be looked at (NATS away) counts as not failed: the same
-- request is asked again, which is what a restarted slurmctld needs, and a failed one holds the
-- job again with its reason.
local function any_failed(conf, run, stages)
	for _, s in ipairs(stages) do
		if wait_one(conf, run, s, 0) == "failed" then
			return true
		end
	end
	return false
end

--- Which run of the job -----------------------------------------------------------------------

-- slurmctld's view of the job: { state = "PENDING", restarts = 0, who = { user, uid, gid,
-- account } }, "gone" when it no longer knows the job, or nil and a message when it cannot be
-- asked. `who` is what the job's directives are checked against (stagehand_slurm.check_access):
-- the account as it is now, after any `scontrol update Account=` since submit.
local function job_record(job_id)
	local p = io.popen("scontrol -o show job " .. quote(job_id) .. " 2>&1; echo \"scontrol-exit=$?\"", "r")
	local out = p:read("*a")
	p:close()
	local state = out:match("JobState=(%S+)")
	if state then
		local user, uid = out:match("UserId=([^%s(]*)%((%d+)%)")
		local account = out:match("Account=(%S+)")
		if account == "(null)" then
			account = nil
		end
		return {
			state = state,
			restarts = tonumber(out:match("Restarts=(%d+)")) or 0,
			who = {
				user = user ~= "" and user or nil,
				uid = tonumber(uid),
				gid = tonumber(out:match("GroupId=[^%s(]*%((%d+)%)")),
				account = account,
			},
		}
	end
	if out:match("Invalid job id") then
		return "gone"
	end
	return nil, first_line(out)
end

-- The job id Stagehand sees for one run of a Slurm job: the prefix and Slurm's id, and ".rN"
-- once the job was requeued N times. A requeued job stages afresh (its earlier run's stages
-- were released, and a release is final); a hook that runs twice in one run asks the same
-- request, unless a stage of it failed: data_in then asks as the run's next attempt, ".aN"
-- appended (slurm_bb_data_in).
local function run_of(conf, job_id, restarts)
	local run = conf.STAGEHAND_JOB_PREFIX .. job_id
	if restarts and restarts > 0 then
		run = run .. ".r" .. restarts
	end
	return run
end

local function run_file(conf, job_id)
	return conf.STAGEHAND_STATE_DIR .. "/" .. job_id .. ".run"
end

-- Whether `asked` (a recorded run) is `run` or one of its later attempts (`run.aN`, below).
local function same_run(asked, run)
	return asked == run or (asked ~= nil and asked:sub(1, #run + 2) == run .. ".a"
		and asked:sub(#run + 3):match("^%d+$") ~= nil)
end

-- The next attempt of `run` after the attempt `asked` failed: "run.a1", then "run.a2", ...
local function next_attempt(asked, run)
	local n = same_run(asked, run) and tonumber(asked:sub(#run + 3)) or 0
	return run .. ".a" .. ((n or 0) + 1)
end

-- The run data_in asked for, as it recorded it (teardown releases exactly that).
local function recorded_run(conf, job_id)
	local f = io.open(run_file(conf, job_id), "r")
	if not f then
		return nil
	end
	local run = f:read("*l")
	f:close()
	return run
end

--- The paths data_in found, for slurm_bb_paths -------------------------------------------------

local function env_file(conf, job_id)
	return conf.STAGEHAND_STATE_DIR .. "/" .. job_id .. ".env"
end

-- Writes `lines` to `path` whole (temp file, rename); nil, or a message.
local function write_whole(conf, path, lines)
	os.execute("mkdir -p " .. quote(conf.STAGEHAND_STATE_DIR))
	local tmp = path .. ".tmp"
	local f, err = io.open(tmp, "w")
	if not f then
		return "stagehand: cannot record the paths in " .. tmp .. ": " .. tostring(err)
	end
	for _, l in ipairs(lines) do
		f:write(l, "\n")
	end
	f:close()
	local ok, rerr = os.rename(tmp, path)
	if not ok then
		return "stagehand: cannot record the paths in " .. path .. ": " .. tostring(rerr)
	end
	return nil
end

local function write_env(conf, job_id, lines)
	return write_whole(conf, env_file(conf, job_id), lines)
end

local function requested_by(uid)
	if uid then
		return "slurm-uid-" .. tostring(uid)
	end
	return "slurm"
end

-- Says where a waiting job's stage stands in its AdminComment, which `scontrol show job` shows
-- while Slurm's own Reason says only BurstBufferStageIn: the promoter's reason and, for a queued
-- copy, the bytes ahead of it and when it should be ready. Best effort: a note not written loses
-- nothing but the note.
local function note(job_id, message)
	if job_id then
		os.execute("scontrol update JobId=" .. quote(job_id) .. " AdminComment=" .. quote(message) .. " >/dev/null 2>&1")
	end
end

-- Waits for every stage until ready, bounded by `budget` seconds in all (0: look once), noting
-- in job `job_id`'s AdminComment (when given) where a waiting stage stands every
-- STAGEHAND_STATUS_EVERY seconds. Returns "ready", env lines; "failed"/"error", message; or
-- "waiting", message.
local function collect(conf, run, stages, budget, job_id)
	local lines = {}
	local deadline = os.time() + budget
	local every = math.max(tonumber(conf.STAGEHAND_STATUS_EVERY) or 30, 1)
	-- The next wait: at most one note's interval, at least a second, none when only looking.
	local function slice()
		return budget > 0 and math.min(math.max(deadline - os.time(), 1), every) or 0
	end
	local noted = false
	for _, s in ipairs(stages) do
		local attempt = os.time()
		local state, detail = wait_one(conf, run, s, slice())
		local outage
		while os.time() < deadline and (state == "unreachable" or state == "waiting") do
			if state == "unreachable" then
				-- NATS away for a while: ask again while the budget lasts.
				outage = outage or outage_began(run, s, "waiting for", detail)
				pace(attempt)
			else
				outage_ended(run, s, "waiting for", outage)
				outage = nil
				note(job_id, "stagehand: waiting for " .. describe(s) .. ": " .. detail)
				noted = true
			end
			attempt = os.time()
			state, detail = wait_one(conf, run, s, slice())
		end
		outage_ended(run, s, "waiting for", state ~= "unreachable" and outage)
		if state == "waiting" then
			note(job_id, "stagehand: waiting for " .. describe(s) .. ": " .. detail)
		end
		if state == "ready" then
			if s.exported then
				lines[#lines + 1] = "STAGEHAND_DATA_" .. s.name .. "=" .. detail
			end
		elseif state == "failed" then
			return "failed", "stagehand: " .. describe(s) .. " failed: " .. detail
		elseif state == "waiting" then
			return "waiting", "stagehand: " .. describe(s) .. " not ready after " .. budget .. " s: " .. detail
		elseif state == "unreachable" then
			return "unreachable", "stagehand: waiting for " .. describe(s) .. ": " .. detail
		else
			return "error", "stagehand: waiting for " .. describe(s) .. ": " .. detail
		end
	end
	if noted then
		note(job_id, "stagehand: data staged")
	end
	return "ready", lines
end

--- The hooks ------------------------------------------------------------------------------------

-- 24.05+ polls test_data_in; 22.05 never calls it, so its data_in must wait itself.
local polled = slurm.SLURM_BB_BUSY ~= nil

-- 23.02+ tells the hooks who asks: uid and gid (and job_info) to job_process and data_in, the
-- caller's uid and gid to get_status. 22.05 does not; its errtab lacks this error name too.
local caller_known = slurm.ESLURM_INVALID_BURST_BUFFER_REQUEST ~= nil

function slurm_bb_job_process(job_script, uid, gid, job_info)
	local conf = load_settings()
	local directives, err = parse_directives(conf, job_script)
	if not directives then
		return slurm.ERROR, "stagehand: " .. err
	end
	-- 23.02+: refuse a project the job may not stage here, at submit. On 22.05 job_process
	-- sees only the script: job_submit.lua refuses it at submit, and data_in checks again.
	if uid ~= nil then
		local info = type(job_info) == "table" and job_info or {}
		local denied = stagehand_slurm.check_access(conf, directives, {
			user = info.user_name,
			uid = tonumber(uid),
			gid = tonumber(gid),
			account = info.account,
		})
		if denied then
			return slurm.ERROR, "stagehand: " .. denied
		end
	end
	return slurm.SUCCESS
end

-- The tiers of STAGEHAND_POOL_TIERS as pools, from the figures `stagehand tier pool` keeps in
-- STAGEHAND_POOL_FILE (stagehand_slurm.slurm_pools). slurmctld asks at start and every 30 s and
-- then stages in only jobs whose capacity= fits a pool's free space. Never an error: an error
-- would stop slurmctld loading the burst buffer's state, and at start no job would be staged.
function slurm_bb_pools()
	local conf = load_settings()
	local json, note = stagehand_slurm.slurm_pools(conf, os.time())
	if note then
		slurm.log_info("stagehand: %s", note)
	end
	if not json then
		return slurm.SUCCESS
	end
	return slurm.SUCCESS, json
end

function slurm_bb_setup(job_id, uid, gid, pool, bb_size, job_script, job_info)
	return slurm.SUCCESS
end

function slurm_bb_data_in(job_id, job_script, uid, gid, job_info)
	local conf = load_settings()
	local directives, err = parse_directives(conf, job_script)
	if not directives then
		return slurm.ERROR, "stagehand: " .. err
	end
	local stages = shared_stages(conf, directives)
	local record, rerr = job_record(job_id)
	if type(record) ~= "table" and uid ~= nil then
		-- 23.02+ names the job's user here too: enough to check against when slurmctld
		-- cannot be asked.
		local info = type(job_info) == "table" and job_info or {}
		record = {
			restarts = 0,
			who = { user = info.user_name, uid = tonumber(uid), gid = tonumber(gid), account = info.account },
		}
	end
	if type(record) ~= "table" then
		return slurm.ERROR, "stagehand: cannot tell who submitted job " .. job_id .. ": " .. (rerr or "slurmctld no longer knows it")
	end
	-- Checked again here, with the job as it is now: the check at submit may be missing
	-- (22.05 without job_submit.lua) or its account changed since.
	local denied = stagehand_slurm.check_access(conf, directives, record.who)
	if denied then
		return slurm.ERROR, "stagehand: " .. denied
	end
	local run = run_of(conf, job_id, record.restarts)
	local asked = recorded_run(conf, job_id)
	if same_run(asked, run) then
		-- This run asked before: slurmctld re-runs data_in after a restart (the same requests),
		-- or the job was held because a stage failed and someone released it (`scontrol
		-- release`, the cause fixed). A failed or released stage is final (its request id is
		-- the job's), so then the job asks afresh as the next attempt, once what the failed
		-- one holds is released (teardown released it already, unless it could not).
		if any_failed(conf, asked, stages) then
			local rerr = release_all(conf, asked, stages)
			if rerr then
				return slurm.ERROR, rerr
			end
			run = next_attempt(asked, run)
			slurm.log_info("stagehand: job %s: a stage of %s failed; asking again as %s", job_id, asked, run)
		else
			run = asked
		end
	end
	local werr = write_whole(conf, run_file(conf, job_id), { run })
	if werr then
		return slurm.ERROR, werr
	end
	-- End before Slurm's own StageInTimeout would kill the hook, so the held job shows
	-- Stagehand's last word rather than a bare timeout.
	local budget = math.max((tonumber(conf.STAGEHAND_STAGE_TIMEOUT) or 3600) - 5, 1)
	local started = os.time()
	local qerr = request_all(conf, run, stages, requested_by(uid), budget, job_hold(conf, job_info))
	if qerr then
		return slurm.ERROR, qerr
	end
	if polled then
		return slurm.SUCCESS
	end
	-- 22.05: wait here.
	local state, result = collect(conf, run, stages, math.max(budget - (os.time() - started), 1), job_id)
	if state ~= "ready" then
		return slurm.ERROR, result
	end
	werr = write_env(conf, job_id, result)
	if werr then
		return slurm.ERROR, werr
	end
	slurm.log_info("stagehand: job %s: data staged", job_id)
	return slurm.SUCCESS
end

function slurm_bb_test_data_in(job_id, job_script, uid, gid, job_info)
	local conf = load_settings()
	local directives, err = parse_directives(conf, job_script)
	if not directives then
		return slurm.ERROR, "stagehand: " .. err
	end
	local run = recorded_run(conf, job_id) or run_of(conf, job_id, 0)
	local state, result = collect(conf, run, shared_stages(conf, directives), 0, job_id)
	-- Not ready yet, or NATS away for now: poll again (StageInTimeout bounds the whole wait).
	if state == "waiting" or state == "unreachable" then
		return slurm.SUCCESS, slurm.SLURM_BB_BUSY
	elseif state ~= "ready" then
		return slurm.ERROR, result
	end
	local werr = write_env(conf, job_id, result)
	if werr then
		return slurm.ERROR, werr
	end
	return slurm.SUCCESS
end

function slurm_bb_real_size(job_id, uid, gid, job_info)
	return slurm.SUCCESS
end

function slurm_bb_paths(job_id, job_script, path_file, uid, gid, job_info)
	local conf = load_settings()
	local src = io.open(env_file(conf, job_id), "r")
	if not src then
		-- A job whose directives are all node-local has no shared paths to export.
		return slurm.SUCCESS
	end
	local contents = src:read("*a")
	src:close()
	local dst, err = io.open(path_file, "a")
	if not dst then
		return slurm.ERROR, "stagehand: cannot write " .. path_file .. ": " .. tostring(err)
	end
	dst:write(contents)
	dst:close()
	return slurm.SUCCESS
end

function slurm_bb_pre_run(job_id, job_script, uid, gid, job_info)
	return slurm.SUCCESS
end

function slurm_bb_post_run(job_id, job_script, uid, gid, job_info)
	return slurm.SUCCESS
end

function slurm_bb_data_out(job_id, job_script, uid, gid, job_info)
	return slurm.SUCCESS
end

function slurm_bb_test_data_out(job_id, job_script, uid, gid, job_info)
	return slurm.SUCCESS
end

function slurm_bb_job_teardown(job_id, job_script, hurry, uid, gid)
	local conf = load_settings()
	local record, serr = job_record(job_id)
	if not record then
		-- Slurm retries a failed teardown; better than releasing data a job may still need.
		return slurm.ERROR, "stagehand: cannot tell whether job " .. job_id .. " still needs its data: " .. serr
	end
	local asked = recorded_run(conf, job_id)
	-- slurmctld restarted during stage-in: it tears the buffer down and stages the same run in
	-- again later. That run still needs its data, so its stages stay (a release is final, and
	-- the request asked again is the same request).
	--
	-- Or its stage-in failed (burst_buffer.conf's Flags=TeardownFailure): Slurm holds the job,
	-- and what the failed attempt holds is released now, not when the job ends (a held job may
	-- wait days for a person); its failed stages stay failed, named by `stagehand status`. The
	-- run file stays, so that data_in, once the job is released, asks as the next attempt.
	if type(record) == "table" and record.state == "PENDING"
		and (asked == nil or same_run(asked, run_of(conf, job_id, record.restarts))) then
		os.remove(env_file(conf, job_id))
		local directives = asked and parse_directives(conf, job_script)
		local stages = directives and shared_stages(conf, directives)
		if stages and any_failed(conf, asked, stages) then
			local rerr = release_all(conf, asked, stages, true)
			if rerr then
				return slurm.ERROR, rerr
			end
			slurm.log_info("stagehand: job %s held: its stage-in (%s) failed; what it held is released", job_id, asked)
			return slurm.SUCCESS
		end
		slurm.log_info("stagehand: job %s pending again (slurmctld restarted during stage-in): its stages stay", job_id)
		return slurm.SUCCESS
	end
	local run = asked or run_of(conf, job_id, type(record) == "table" and record.restarts or 0)
	local directives, err = parse_directives(conf, job_script)
	if not directives then
		-- Refused at submit or unreadable now: nothing was requested that we can name.
		slurm.log_info("stagehand: job %s teardown: %s", job_id, err)
		os.remove(env_file(conf, job_id))
		os.remove(run_file(conf, job_id))
		return slurm.SUCCESS
	end
	if asked == nil and type(record) == "table" and stagehand_slurm.check_access(conf, directives, record.who) then
		-- data_in refused the job's projects and asked nothing: nothing to release, and no
		-- release is published for a project this job may not stage.
		os.remove(env_file(conf, job_id))
		return slurm.SUCCESS
	end
	-- Slurm retries a failed teardown; the release id is the same each time.
	local rerr = release_all(conf, run, shared_stages(conf, directives))
	if rerr then
		return slurm.ERROR, rerr
	end
	os.remove(env_file(conf, job_id))
	os.remove(run_file(conf, job_id))
	return slurm.SUCCESS
end

-- `scontrol show bbstat [JOB | D@V] [--project P | project=P]`: Stagehand's view of the stages
-- of the projects the caller may stage (the uid=, user= and gid= rules of stagehand-slurm.conf;
-- accounts belong to jobs, not to callers), or of P when it is one of them; root sees any P it
-- names. 23.02+ passes the caller's uid and gid before the words typed after "bbstat"; 22.05
-- passes only the words, so it cannot tell who asks and shows no stages at all.
function slurm_bb_get_status(...)
	local args = { ... }
	local words = args
	if caller_known then
		words = {}
		for i = 3, #args do
			words[#words + 1] = args[i]
		end
	end
	local target, project
	local i = 1
	while i <= #words do
		local w = tostring(words[i])
		if w == "--project" or w == "-p" then
			project = words[i + 1] and tostring(words[i + 1]) or ""
			i = i + 1
		elseif w:match("^--project=") or w:match("^project=") then
			project = w:match("=(.*)$")
		elseif w:sub(1, 1) == "-" or target then
			return slurm.SUCCESS, "stagehand: bbstat takes [JOB | DATASET@VERSION] [project=P]; '" .. w .. "' is neither\n"
		else
			target = w
		end
		i = i + 1
	end
	if not caller_known then
		return slurm.SUCCESS, "stagehand: this Slurm does not tell bbstat who asks (23.02+ does), so it "
			.. "shows no stages; ask `stagehand stage status` with your project's own NATS user\n"
	end
	local conf = load_settings()
	local uid, gid = tonumber(args[1]), tonumber(args[2])
	local projects
	if uid == 0 then
		if not project then
			return slurm.SUCCESS, "stagehand: name the project: bbstat [JOB | DATASET@VERSION] project=P\n"
		end
		projects = { project }
	else
		local p = io.popen("getent passwd " .. quote(tostring(uid)) .. " 2>/dev/null")
		local user = (p:read("*a") or ""):match("^([^:\n]+):")
		p:close()
		local mine = stagehand_slurm.projects_of(conf, { user = user, uid = uid, gid = gid })
		projects = mine
		if project then
			projects = {}
			for _, m in ipairs(mine) do
				if m == project then
					projects = { project }
				end
			end
			if #projects == 0 then
				return slurm.SUCCESS, "stagehand: uid " .. tostring(uid) .. " may not see project '" .. project .. "'\n"
			end
		end
	end
	local shown = {}
	for _, p in ipairs(projects) do
		local query = { "stage", "status" }
		if target then
			query[#query + 1] = target
		end
		query[#query + 1] = "--project"
		query[#query + 1] = p
		local code, out, err = stagehand(conf, query)
		if code ~= 0 then
			return slurm.ERROR, first_line(err ~= "" and err or out)
		end
		shown[#shown + 1] = out
	end
	if #shown == 0 then
		return slurm.SUCCESS, "stagehand: no project of yours (uid " .. tostring(uid) .. ") in " .. conf.path .. "\n"
	end
	return slurm.SUCCESS, table.concat(shown)
end
